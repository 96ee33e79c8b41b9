//! Fused dequantize-dot kernels for [`QuantMatrix`].
//!
//! Every kernel computes, for one row,
//!
//! ```text
//!     Σ_g ( scale_g · Σ_{j∈g} q_j·x_j  +  bias_g · xsum_g ),     xsum_g = Σ_{j∈g} x_j
//! ```
//!
//! with f32 accumulation: the scale term accumulates in SIMD lanes group by group, the bias term
//! `Σ_g bias_g·xsum_g` is a separate short dot product at the end of the row. `xsum` (and, for some
//! kernels, a reordered or rescaled copy of `x`) is computed once per `dot_rows` call by fixed-order
//! code. Rows are processed four at a time to share the loads of `x` and to keep independent
//! accumulation chains in flight, but each row's result goes through exactly the same operation
//! sequence whether it is processed in a block of four or alone, so it depends only on the row, `x`
//! and the kernel — and the kernel is fixed per process ([`Kernel::detect`]). While a block of rows
//! is computed, the next block's weights are prefetched (the rows of a block are only `cols/2` bytes
//! long each, too short for the hardware prefetchers to ramp up on their own).

#![allow(clippy::needless_range_loop)] // lane/row-indexed SIMD code reads best with indices

use std::cell::RefCell;

use super::QuantMatrix;

/// The dot kernel implementations. Results of different kernels agree to rounding, not bitwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Portable Rust (8-lane arrays LLVM vectorises with whatever the build target allows; nibbles
    /// are masked in place and `x` is pre-scaled by `2^-4k`, so no per-lane shifts are needed).
    Portable,
    /// x86-64 AVX2 + FMA: 8 nibbles of one word → 8 lanes by variable shifts.
    Avx2,
    /// x86-64 AVX-512F: 2 words → 16 lanes, nibbles → floats by a 16-entry `vpermps` table lookup.
    Avx512,
}

impl Kernel {
    /// The fastest kernel this CPU supports (capped like every CPU kernel by `MEGAGEMMA_SIMD`,
    /// see [`crate::simd::level`]).
    pub fn detect() -> Kernel {
        match crate::simd::level() {
            crate::simd::Level::Avx512 => Kernel::Avx512,
            crate::simd::Level::Avx2 => Kernel::Avx2,
            crate::simd::Level::Portable => Kernel::Portable,
        }
    }

    /// All kernels that can run on this CPU, slowest first.
    pub fn available() -> Vec<Kernel> {
        #[allow(unused_mut)]
        let mut v = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Kernel::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(Kernel::Avx512);
            }
        }
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "portable",
            Kernel::Avx2 => "avx2+fma",
            Kernel::Avx512 => "avx512f",
        }
    }
}

thread_local! {
    /// Per-thread scratch: `[xsum (n_groups) | reordered / rescaled x (cols)]`.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn dot_rows(m: &QuantMatrix, kernel: Kernel, start: usize, x: &[f32], out: &mut [f32]) {
    if out.is_empty() {
        return;
    }
    let need = m.groups_per_row() + if kernel == Kernel::Avx2 { 0 } else { m.cols };
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < need {
                buf.resize(need, 0.0);
            }
            run(m, kernel, start, x, out, &mut buf[..need]);
        }
        // Re-entered on this thread (cannot happen through matmul): use a fresh buffer.
        Err(_) => run(m, kernel, start, x, out, &mut vec![0.0; need]),
    });
}

fn run(m: &QuantMatrix, kernel: Kernel, start: usize, x: &[f32], out: &mut [f32], scratch: &mut [f32]) {
    let (xsum, xt) = scratch.split_at_mut(m.groups_per_row());
    group_sums(x, m.group_size, xsum);
    match kernel {
        Kernel::Portable => {
            portable::prescale_x(x, xt);
            portable::dot_rows(m, start, xsum, xt, out)
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => {
            assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"), "AVX2+FMA not available");
            // SAFETY: the features were just checked.
            unsafe { avx2::dot_rows(m, start, x, xsum, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => {
            assert!(is_x86_feature_detected!("avx512f"), "AVX-512F not available");
            avx512::interleave_x(x, xt);
            // SAFETY: the feature was just checked.
            unsafe { avx512::dot_rows(m, start, xsum, xt, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => panic!("kernel {kernel:?} is not available on this architecture"),
    }
}

/// `xsum[g] = Σ x[g·gs .. (g+1)·gs]`, 8 lanes then a fixed tree: the same for every kernel and call.
fn group_sums(x: &[f32], gs: usize, xsum: &mut [f32]) {
    for (s, xg) in xsum.iter_mut().zip(x.chunks_exact(gs)) {
        let mut acc = [0f32; 8];
        for x8 in xg.chunks_exact(8) {
            for k in 0..8 {
                acc[k] += x8[k];
            }
        }
        *s = hsum8(&acc);
    }
}

#[inline(always)]
fn hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Rows per block in the kernels.
const R: usize = 4;

/// Calls `f(row0, out_block, prefetch_next)` for blocks of `R` rows, then single rows.
#[inline(always)]
fn for_blocks(m: &QuantMatrix, start: usize, out: &mut [f32], mut f4: impl FnMut(usize, &mut [f32], bool), mut f1: impl FnMut(usize, &mut [f32])) {
    let mut blocks = out.chunks_exact_mut(R);
    let mut row = start;
    for o in &mut blocks {
        f4(row, o, row + 2 * R <= m.rows);
        row += R;
    }
    for o in blocks.into_remainder().chunks_mut(1) {
        f1(row, o);
        row += 1;
    }
}

mod portable {
    use super::*;

    /// `xt[8i + k] = x[8i + k] · 2^-4(k mod 4)`: exact (a power-of-two scaling), so that
    /// `(w & 0xF << 4k) as f32 · xt` rounds exactly like `q·x`.
    pub(super) fn prescale_x(x: &[f32], xt: &mut [f32]) {
        const S: [f32; 8] = [1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0, 1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0];
        for (d, s) in xt.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
            for k in 0..8 {
                d[k] = s[k] * S[k];
            }
        }
    }

    pub(super) fn dot_rows(m: &QuantMatrix, start: usize, xsum: &[f32], xt: &[f32], out: &mut [f32]) {
        for_blocks(m, start, out, |r, o, _| rows::<R>(m, r, xsum, xt, o), |r, o| rows::<1>(m, r, xsum, xt, o));
    }

    #[inline(always)]
    fn mac8(acc: &mut [f32; 8], w: u32, xt: &[f32]) {
        const MASK: [u32; 8] = [0xF, 0xF0, 0xF00, 0xF000, 0xF, 0xF0, 0xF00, 0xF000];
        let lanes = [w, w, w, w, w >> 16, w >> 16, w >> 16, w >> 16];
        for k in 0..8 {
            acc[k] += (lanes[k] & MASK[k]) as i32 as f32 * xt[k];
        }
    }

    /// `N` consecutive rows from `row0`; per row the same operations whatever `N`.
    #[inline(always)]
    fn rows<const N: usize>(m: &QuantMatrix, row0: usize, xsum: &[f32], xt: &[f32], out: &mut [f32]) {
        let wpr = m.cols / 8;
        let wpg = m.group_size / 8;
        let ng = m.groups_per_row();
        let w: [&[u32]; N] = std::array::from_fn(|r| &m.packed[(row0 + r) * wpr..(row0 + r + 1) * wpr]);
        let sc: [&[f32]; N] = std::array::from_fn(|r| &m.scales[(row0 + r) * ng..(row0 + r + 1) * ng]);
        let mut acc = [[0f32; 8]; N];
        for g in 0..ng {
            let mut ga = [[0f32; 8]; N];
            for i in g * wpg..(g + 1) * wpg {
                let xv = &xt[i * 8..i * 8 + 8];
                for r in 0..N {
                    mac8(&mut ga[r], w[r][i], xv);
                }
            }
            for r in 0..N {
                let s = sc[r][g];
                for k in 0..8 {
                    acc[r][k] += s * ga[r][k];
                }
            }
        }
        for r in 0..N {
            let b = &m.biases[(row0 + r) * ng..(row0 + r + 1) * ng];
            let mut bacc = [0f32; 8];
            let mut bc = b.chunks_exact(8);
            let mut xc = xsum.chunks_exact(8);
            for (b8, x8) in (&mut bc).zip(&mut xc) {
                for k in 0..8 {
                    bacc[k] += b8[k] * x8[k];
                }
            }
            let mut tail = 0f32;
            for (b, x) in bc.remainder().iter().zip(xc.remainder()) {
                tail += b * x;
            }
            out[r] = hsum8(&acc[r]) + (hsum8(&bacc) + tail);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_rows(m: &QuantMatrix, start: usize, x: &[f32], xsum: &[f32], out: &mut [f32]) {
        match m.group_size {
            32 => for_blocks(m, start, out, |r, o, p| rows::<R, 4>(m, r, x, xsum, o, p), |r, o| rows::<1, 4>(m, r, x, xsum, o, false)),
            64 => for_blocks(m, start, out, |r, o, p| rows::<R, 8>(m, r, x, xsum, o, p), |r, o| rows::<1, 8>(m, r, x, xsum, o, false)),
            _ => for_blocks(m, start, out, |r, o, p| rows::<R, 16>(m, r, x, xsum, o, p), |r, o| rows::<1, 16>(m, r, x, xsum, o, false)),
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// `Σ_g b[g]·xsum[g]`: 8 lanes, scalar tail, fixed order.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn bias_dot(b: *const f32, xsum: &[f32]) -> f32 {
        let ng = xsum.len();
        let mut acc = _mm256_setzero_ps();
        let mut g = 0;
        while g + 8 <= ng {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(b.add(g)), _mm256_loadu_ps(xsum.as_ptr().add(g)), acc);
            g += 8;
        }
        let mut tail = 0f32;
        while g < ng {
            tail = (*b.add(g)).mul_add(xsum[g], tail);
            g += 1;
        }
        hsum(acc) + tail
    }

    /// `N` rows from `row0`, group size `8·WPG`; per row the same operations whatever `N`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn rows<const N: usize, const WPG: usize>(m: &QuantMatrix, row0: usize, x: &[f32], xsum: &[f32], out: &mut [f32], prefetch: bool) {
        let wpr = m.cols / 8;
        let ng = m.groups_per_row();
        debug_assert!((row0 + N) * wpr <= m.packed.len() && x.len() == m.cols && out.len() >= N);
        let wbase = m.packed.as_ptr().add(row0 * wpr);
        let sbase = m.scales.as_ptr().add(row0 * ng);
        let xp = x.as_ptr();
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mask = _mm256_set1_epi32(0xF);
        let mut acc = [_mm256_setzero_ps(); N];
        for g in 0..ng {
            let wg = wbase.add(g * WPG);
            let xg = xp.add(g * WPG * 8);
            let mut ga = [_mm256_setzero_ps(); N];
            for i in 0..WPG {
                let xv = _mm256_loadu_ps(xg.add(i * 8));
                for r in 0..N {
                    let w = _mm256_set1_epi32(*wg.add(r * wpr + i) as i32);
                    let q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, shifts), mask));
                    ga[r] = _mm256_fmadd_ps(q, xv, ga[r]);
                }
            }
            if prefetch {
                prefetch_next::<N, WPG>(m, wg, sbase, g, wpr, ng);
            }
            for r in 0..N {
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(*sbase.add(r * ng + g)), ga[r], acc[r]);
            }
        }
        for r in 0..N {
            out[r] = hsum(acc[r]) + bias_dot(m.biases.as_ptr().add((row0 + r) * ng), xsum);
        }
    }

    /// Prefetches group `g` of the next block's rows (one cache line of weights per 64 bytes of
    /// group data, scales and biases every 16 groups).
    #[inline(always)]
    pub(super) unsafe fn prefetch_next<const N: usize, const WPG: usize>(m: &QuantMatrix, wg: *const u32, sbase: *const f32, g: usize, wpr: usize, ng: usize) {
        if (g * WPG * 4).is_multiple_of(64) {
            for r in 0..N {
                _mm_prefetch::<_MM_HINT_T0>(wg.add((N + r) * wpr) as *const i8);
            }
        }
        if g.is_multiple_of(16) {
            let bbase = m.biases.as_ptr().offset(sbase.offset_from(m.scales.as_ptr()));
            for r in 0..N {
                _mm_prefetch::<_MM_HINT_T0>(sbase.add((N + r) * ng + g) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(bbase.add((N + r) * ng + g) as *const i8);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Reorders `x` per 16-element block to match the lanes of a broadcast word pair:
    /// lane `2k` holds element `k` (word 0), lane `2k+1` element `8+k` (word 1).
    pub(super) fn interleave_x(x: &[f32], xi: &mut [f32]) {
        for (src, dst) in x.chunks_exact(16).zip(xi.chunks_exact_mut(16)) {
            for k in 0..8 {
                dst[2 * k] = src[k];
                dst[2 * k + 1] = src[8 + k];
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_rows(m: &QuantMatrix, start: usize, xsum: &[f32], xi: &[f32], out: &mut [f32]) {
        match m.group_size {
            32 => for_blocks(m, start, out, |r, o, p| rows::<R, 4>(m, r, xsum, xi, o, p), |r, o| rows::<1, 4>(m, r, xsum, xi, o, false)),
            64 => for_blocks(m, start, out, |r, o, p| rows::<R, 8>(m, r, xsum, xi, o, p), |r, o| rows::<1, 8>(m, r, xsum, xi, o, false)),
            _ => for_blocks(m, start, out, |r, o, p| rows::<R, 16>(m, r, xsum, xi, o, p), |r, o| rows::<1, 16>(m, r, xsum, xi, o, false)),
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn hsum(v: __m512) -> f32 {
        // Fixed tree: 512 → 256 → 128 → 64 → 32.
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s = _mm256_add_ps(lo, hi);
        let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// `Σ_g b[g]·xsum[g]`: 16 lanes, masked tail, fixed order.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn bias_dot(b: *const f32, xsum: &[f32]) -> f32 {
        let ng = xsum.len();
        let mut acc = _mm512_setzero_ps();
        let mut g = 0;
        while g + 16 <= ng {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(b.add(g)), _mm512_loadu_ps(xsum.as_ptr().add(g)), acc);
            g += 16;
        }
        if g < ng {
            let k: __mmask16 = (1u16 << (ng - g)) - 1;
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, b.add(g)), _mm512_maskz_loadu_ps(k, xsum.as_ptr().add(g)), acc);
        }
        hsum(acc)
    }

    /// `N` rows from `row0`, group size `8·WPG`; per row the same operations whatever `N`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn rows<const N: usize, const WPG: usize>(m: &QuantMatrix, row0: usize, xsum: &[f32], xi: &[f32], out: &mut [f32], prefetch: bool) {
        let wpr = m.cols / 8;
        let ng = m.groups_per_row();
        debug_assert!((row0 + N) * wpr <= m.packed.len() && xi.len() == m.cols && out.len() >= N);
        let wbase = m.packed.as_ptr().add(row0 * wpr);
        let sbase = m.scales.as_ptr().add(row0 * ng);
        let xp = xi.as_ptr();
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        // vpermps reads only the low 4 bits of each index lane: nibble → its value as f32.
        let table = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let mut acc = [_mm512_setzero_ps(); N];
        for g in 0..ng {
            let wg = wbase.add(g * WPG);
            let xg = xp.add(g * WPG * 8);
            let mut ga = [_mm512_setzero_ps(); N];
            // Two words (16 weights) per step.
            for i in 0..WPG / 2 {
                let xv = _mm512_loadu_ps(xg.add(i * 16));
                for r in 0..N {
                    let p = _mm512_set1_epi64((wg.add(r * wpr + 2 * i) as *const i64).read_unaligned());
                    let q = _mm512_permutexvar_ps(_mm512_srlv_epi32(p, shifts), table);
                    ga[r] = _mm512_fmadd_ps(q, xv, ga[r]);
                }
            }
            if prefetch {
                super::avx2::prefetch_next::<N, WPG>(m, wg, sbase, g, wpr, ng);
            }
            for r in 0..N {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(*sbase.add(r * ng + g)), ga[r], acc[r]);
            }
        }
        for r in 0..N {
            out[r] = hsum(acc[r]) + bias_dot(m.biases.as_ptr().add((row0 + r) * ng), xsum);
        }
    }
}
